"""Reference (naive) math, one readable module per optimizer; the fused kernels are checked against it."""
