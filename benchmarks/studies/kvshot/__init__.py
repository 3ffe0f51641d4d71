"""The KVShot study (docs/kvshot.md) and its redo (issue 29, docs/kvshot2.md).

- kvshot.py: trains the pilot's matrix (configs/study/) and the redo's (`matrix`),
  rebuilds docs/kvshot.md (`report`, through kvshot_report.py);
- kvshot_runs.py: both matrices' run names and where each run lives;
- kvshot_probes.py: the probes of KV-reusing drafters' two bottlenecks;
- protocol.py: the redo's measurement (simulated and in-loop acceptance, probes) and the
  statistics of its results, which benchmarks/medc.py reuses;
- kvshot_study2.py: measures the redo's runs and renders docs/kvshot2.md;
- kvshot_device.py: the redo on a lent accelerator (train, measure, pack).
"""
