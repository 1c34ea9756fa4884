// argmax_check ROWS VOCAB FILE THREADS: the ArgmaxPool's index for each row of a float32 file,
// one per line, for tests/examples/test_cpp_host.py to compare with torch.argmax.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "argmax.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: argmax_check ROWS VOCAB FILE THREADS\n");
    return 2;
  }
  long rows = std::atol(argv[1]), vocab = std::atol(argv[2]);
  std::vector<float> logits(static_cast<size_t>(rows * vocab));
  std::FILE* f = std::fopen(argv[3], "rb");
  if (f == nullptr || std::fread(logits.data(), sizeof(float), logits.size(), f) != logits.size()) {
    std::fprintf(stderr, "cannot read %ld x %ld floats from %s\n", rows, vocab, argv[3]);
    return 2;
  }
  std::fclose(f);
  std::vector<int32_t> out(rows);
  cpp_host::ArgmaxPool pool(std::atoi(argv[4]));
  pool.run(logits.data(), rows, vocab, out.data());
  for (int32_t token : out) std::printf("%d\n", token);
  return 0;
}
