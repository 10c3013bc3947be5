"""``python -m rr_patches.selfcheck sglang`` (what docker/install_rr.sh runs in the SGLang image) on every release."""

from __future__ import annotations

import pytest

from rr_patches.selfcheck import check_sglang
from rr_server.serving.engines.sglang import profile_for

pytestmark = pytest.mark.sglang


def test_the_patch_fits_this_release() -> None:
    profile = profile_for()
    line = check_sglang()
    assert line.startswith(f"SGLang {profile.version}: rr's hooks fit sglang.srt.managers.tokenizer_manager.")
    assert line.endswith(
        "through SGLang's HookRegistry" if profile.has_plugins else "patched directly (no plugin system)"
    )
