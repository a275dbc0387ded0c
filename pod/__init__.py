"""The machine a job runs on, apart from how arrays are split over it (sharding/): TPU
topologies and compile-only devices (topology.py), multi-host start-up (distributed.py),
ahead-of-time compiles and their per-chip memory report (aot.py), and the roofline of a
compiled program at a chip's peak rates (roofline.py). Knows devices and compiled programs,
never the model."""
