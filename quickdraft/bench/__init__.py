"""What the measuring commands run (`tune`, `bench`, `verify`, `bench-serve`) and what the
`benchmarks/` scripts share: the timing harness, workloads, peers, the load generator. The
runtime never imports this package; the cost model it fills is `quickdraft.policy.costs`."""
