"""The benchmarks' shared library (one package; a benchmark script imports from here,
never from another script).

- `benchmarks.lib.sessions`: systems built as decode.py builds them, from a
  `DecodeConfig` (`config`, `engine`, `engine_set`, `autoregressive`, `ar_config`), and
  how they are timed side by side (`compile_all`, `warm_up`, `run_interleaved`).
- `benchmarks.lib.prompts`: the bundled prompts as decode.py reads them (`prompt_ids`,
  `prompt_file`), held-out prompts of the regenerated validation stream
  (`held_out_prompts`, `VAL_NPY`) and held-out real text (`text_ids`).
- `benchmarks.lib.provenance`: written once for every results file: the code
  (`git_rev`, `git_state`, `changed_files`), the weights (`sha256`, `sha256_prefix`), the
  machine and software (`stamp`, `environment`, `installed_environment`, `machine`,
  `usable_cores`) and the command line (`command_line`).
- `benchmarks.lib.stats`: `summary` (median, min, max), `common_prefix`, `equality`, and
  the crossed seeds x prompts `bootstrap_ci` with its statistics (`ratio`, `speed_ratio`,
  `difference`).
- `benchmarks.lib.report`: `save_results` (the JSON, and the document's table when it is
  the committed file), `write_json`, `replace_doc_section`, `fmt`.
- `benchmarks.lib.systems` and `benchmarks.lib.compare_tables`: benchmarks/compare.py's
  systems (a session's engine, transformers `generate`), their interleaved timing and
  its tables and plot.
- `benchmarks.lib.roofline`: the analytic byte and FLOP model of the Pallas kernels and
  the jnp paths they replace (`verify_bytes`, `attention_bytes`, `packed_train_bytes`,
  `jnp_train_bytes`, ..., `roofline_ms`), the devices' vendor figures (`BANDWIDTH`,
  `PEAK_FLOPS`, `SMS`) and Qwen3-8B's shapes (`QWEN3_8B`): benchmarks/kernels.py's tables,
  the device rounds' roofline fractions.
- `benchmarks.lib.system_table`: benchmarks/trees.py's systems measured against
  autoregressive decoding (`System`, `SYSTEMS`, `SWEEP`, `measure`, `merge`, `render`, the
  accelerator projection `project`), which benchmarks/block_drafting.py reuses.

jax, torch and transformers are imported inside the functions: a benchmark script sets
its environment (JAX_NUM_CPU_DEVICES, HF offline flags) before the first jax import.
"""
