"""Training: configs, the device mesh and its sharding rules, the optimizer, and the loop.

    from specjax.train import load_config, train
    result = train(load_config("configs/demo_target.yaml", ["train.steps=20"]))

Modules: config (YAML -> frozen dataclasses), mesh (mesh, logical-axis rules,
NamedShardings), optim (AdamW schedule), step (train state, lm loss, jitted steps),
drafter_step (the drafter trainer: frozen target inside the step, objectives ttt and
block), drafter_run (a drafter run's validation alpha/tau, best-tau snapshot, export),
objectives (the drafter losses), inputs (token streams, tokenizer), checkpointing
(orbax, SIGTERM), multihost (several processes: start-up, agreeing on errors), loop
(train).
"""

from specjax.train.config import TrainConfig, load_config
from specjax.train.loop import RunResult, train

__all__ = ["RunResult", "TrainConfig", "load_config", "train"]
