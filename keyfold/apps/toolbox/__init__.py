"""The toolbox: attention beside the sequence models it competes with, measured honestly.

- :mod:`.mixers`: seven causal mixers behind one interface, each with a streaming step.
- :mod:`.model`: one residual block and :class:`SequenceModel` around every mixer.
- :mod:`.tasks`: synthetic tasks as their papers define them (MQAR, selective copying,
  induction heads).
- :mod:`.data`: real series shipped in packages (statsmodels forecasting sets, UCR
  classification sets from sktime/aeon) and the forecasting baselines.
- :mod:`.bench`: ``python -m keyfold bench toolbox``. Docs: ``docs/toolbox.md``.
"""

from keyfold._extras import require as _require

_require("toolbox", "keyfold.apps.toolbox")

from .mixers import (AttentionMixer, GRUMixer, LinearAttentionMixer, LSTMMixer, Mixer, MixerKind,
                     MLPMixer, S4DMixer, TCNMixer, make_mixer, state_nbytes)
from .model import Block, SequenceModel

__all__ = [
    "MixerKind", "Mixer", "AttentionMixer", "GRUMixer", "LSTMMixer", "TCNMixer",
    "LinearAttentionMixer", "S4DMixer", "MLPMixer", "make_mixer", "state_nbytes",
    "Block", "SequenceModel",
]
