// A kernel that does nothing: the stand-in of native.cluster_fit's occupancy queries, where what
// decides is the shared memory each CTA takes and the GPCs' sizes, not the kernel.
extern "C" __global__ void probe() {}
