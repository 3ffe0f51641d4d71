"""EAGLE-3 drafter (hidden states only; Li et al. 2025, arXiv 2503.01840; layout of
SafeAILab/EAGLE and SpecForge, docs/design.md section 5).

One decoder layer over x_t = [embed_norm(embed(token_{t+1})) ; hidden_norm(h_t)] (2D
features), with h as its residual: h_0 = fc(concat of target features at 3 depths),
later steps feed back the layer's own pre-norm output. Logits come from the target's LM
head after the drafter's final norm (an imported EAGLE-3 head's own head over a hot
vocabulary: `learned.LearnedDrafter.logits`, `external.py`). Entry t (RoPE position t)
pairs feature t with token t+1 and predicts token t+2.

Decoding state (`Eagle3State`): the drafter's one-layer KV cache [1,B,K,S,H], valid for
positions 0..lengths-2 (built from TARGET features of committed tokens), and h_last
[B,D], its output at position lengths-2, which predicts the first draft token. Each
step drafts with G-1 one-token forwards (positions lengths-1 .. lengths+G-3, their
keys in a small buffer beside the read-only cache) and, after verification, writes the
entries of the newly committed positions in one (G+1)-token forward from the verify
pass's target features.

The package, by concern (medc.py and hybrid.py build on it):
  network.py  `Eagle3`, the nnx module (and its TTT unroll);
  state.py    `Eagle3State`;
  drafter.py  `Eagle3Drafter`, the loop adapter: init, propose, update, report;
  propose.py  the chain proposal: plain, early stop and reuse over one carry;
  reuse.py    medc's reuse of drafted hidden states (`DraftChain`);
  trees.py    the dynamic draft tree (`propose_tree_topk`);
  kind.py     `Eagle3Kind` (registered at import) and `eagle3_capture`.
"""

from specjax.drafters.eagle3.drafter import Eagle3Drafter
from specjax.drafters.eagle3.kind import Eagle3Kind, eagle3_capture
from specjax.drafters.eagle3.network import Eagle3
from specjax.drafters.eagle3.reuse import DraftChain
from specjax.drafters.eagle3.state import Eagle3State

__all__ = ["DraftChain", "Eagle3", "Eagle3Drafter", "Eagle3Kind", "Eagle3State",
           "eagle3_capture"]
