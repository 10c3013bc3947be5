"""``rr_client.replay.cost``, kept where users import it: :mod:`rr_client.trainer.replay.cost`."""

from rr_client.trainer.replay.cost import *  # noqa: F401,F403
from rr_client.trainer.replay.cost import __all__ as __all__  # noqa: F401
