"""``rr_client.metrics``, kept where users import it: :mod:`rr_client.trainer.metrics`."""

from rr_client.trainer.metrics import *  # noqa: F401,F403
from rr_client.trainer.metrics import __all__ as __all__  # noqa: F401
