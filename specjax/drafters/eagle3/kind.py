"""The eagle3 drafter kind (`Eagle3Kind`, registered at import) and EAGLE-3's capture
depths (`eagle3_capture`); medc.MedcKind and hybrid.HybridKind subclass it."""

from __future__ import annotations

from specjax.drafters import registry
from specjax.drafters.eagle3.drafter import Eagle3Drafter
from specjax.drafters.eagle3.network import Eagle3
from specjax.errors import SpecjaxError


def eagle3_capture(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's capture depths: the inputs of layers {2, L/2, L-3} (any three depths of a
    shallow target)."""
    L = num_layers
    capture = tuple(sorted({min(2, L), L // 2, max(L - 3, 0)}))
    if len(capture) < 3:  # shallow targets: any three depths
        capture = tuple(sorted({0, L // 2, L}))
    return capture


class Eagle3Kind(registry.DrafterKind):
    """eagle3: one layer over target features at three depths; TTT; stops early. Its
    attention reads no target K/V, so an imported head's N, K, H may differ from the
    target's."""

    name, network, adapter, objective = "eagle3", Eagle3, Eagle3Drafter, "ttt"
    early_stop = True
    reads_target_kv_shapes = False
    default_num_layers = 1

    def defaults(self, target, opts):
        return {"capture": eagle3_capture(target.num_layers), "kv_layers": ()}

    def validate(self, cfg):
        if cfg.num_layers != 1:
            raise SpecjaxError(f"{cfg.kind} drafters have one layer, got num_layers="
                               f"{cfg.num_layers}")

    def uses_hidden(self, cfg):
        return True

    def state_layers(self, cfg):
        return 1 + cfg.num_memories  # its own one-layer cache (+ the hybrid's memory)


registry.register(Eagle3Kind())
