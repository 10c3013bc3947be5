"""``rr_client.replay``, kept where users import it: the trainer layer's :mod:`rr_client.trainer.replay`.

Replay (R3), recording (R2) and the audit live in :mod:`rr_client.trainer.replay`; this package re-exports its
public names, and ``rr_client.replay.coverage`` / ``.cost`` / ``.formulas`` re-export those modules.
"""

from rr_client.trainer.replay import *  # noqa: F401,F403
from rr_client.trainer.replay import __all__ as __all__  # noqa: F401
