"""``rr_client.replay.coverage``, kept where users import it: :mod:`rr_client.trainer.replay.coverage`."""

from rr_client.trainer.replay.coverage import *  # noqa: F401,F403
from rr_client.trainer.replay.coverage import __all__ as __all__  # noqa: F401

if __name__ == "__main__":
    raise SystemExit(main())  # noqa: F405 - ``python -m rr_client.replay.coverage`` as before
