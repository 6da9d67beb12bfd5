"""Fused ELO: small_fc_lopt's kernels (``lopt/fused/small_fc_lopt.py``) with ELO's two traits.

ELO computes small_fc_lopt's accumulators, features, normalisation, time features and MLP
(``docs/elo.md``); its decays are the raw values ``ELO.decays`` gives, which the engine packs into the
group table as it packs small_fc_lopt's, and its groups have no ``step_mult`` (the table holds 1). What
differs is declared here and nothing else is written twice:

* the update rule (``WEIGHT_DECAY_INSIDE_STEP``): ``p ← p − lr·(u + weight_decay·p)``, the pre-update
  value inside the step (``apply_update`` in ``cuda_src/accumulators.cuh``; reference
  ``lopt.reference.elo.apply_update``);
* ``max_grad_norm`` clips by the global norm (``GLOBAL_CLIPPING``): the axis pass sums every tensor's
  g², and ``FusedEngine._global_clip_factors`` turns the total into each clipping group's factor before
  the accumulate phase's factor tables and the later passes read it (reference ``global_clip_factor``).
"""

from __future__ import annotations

from lopt.fused.small_fc_lopt import SmallFCLOptFused


class ELOFused(SmallFCLOptFused):
    """The fused engine behind ``ELO(backend="fused")``."""

    WEIGHT_DECAY_INSIDE_STEP = True
    GLOBAL_CLIPPING = True
