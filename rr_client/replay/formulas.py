"""``rr_client.replay.formulas``, kept where users import it: :mod:`rr_client.trainer.replay.formulas`."""

from rr_client.trainer.replay.formulas import *  # noqa: F401,F403
from rr_client.trainer.replay.formulas import __all__ as __all__  # noqa: F401
