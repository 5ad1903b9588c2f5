"""The device rules, each written once over `ArrayOps`: the loss-scale rule, the spike rule, the record code.

`polyamp.LossScaleConfig.next_state` and `polyamp.SpikeRule.decide` are the host references; these are the
same rules as array operations, which every backend's device calls with its own `ArrayOps` (a framework's
fused kernel may stand in where it computes the same values, tested bit for bit). No backend writes a
rule's arithmetic itself.
"""

from polyamp._src.rules import fp8 as fp8
from polyamp._src.rules._ops import ArrayOps as ArrayOps
from polyamp._src.rules.codes import *  # noqa: F403
from polyamp._src.rules.loss_scale import *  # noqa: F403
from polyamp._src.rules.spike import *  # noqa: F403
