"""The fast CPU platform: the reference's ops and collectives with a batched SDPA attention over
the paged cache, run eagerly; what ``xhal-serve --device cpu`` serves with. ``cpu_ref`` stays the
oracle: this platform is checked by the conformance suite like any other backend."""
