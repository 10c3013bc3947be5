"""The P/D sidecar's count of the weight updates each server took (rr_server.proxy.pd_weights): halves from servers
whose counts differ are refused; an update both servers take brings them together again."""

from __future__ import annotations

from rr_server.proxy.pd_weights import UpdateLedger

P, D = "http://prefill:1", "http://decode:2"


def test_counts_follow_the_updates_each_server_took() -> None:
    ledger = UpdateLedger([P, D])
    assert ledger.begin("/flush_cache", b"{}") is None and ledger.refusal(ledger.counts()) is None
    n = ledger.begin("/update_weights_from_disk", b'{"model_path": "/w/step-1"}')
    ledger.took(P, n, True)
    before = ledger.counts()  # a sample admitted while the update had reached the prefill server only
    ledger.took(D, n, False)  # the decode server answered an error: its weights are unknown
    assert ledger.info() == {P: 1, D: None}
    why = ledger.refusal(ledger.counts())
    assert why is not None and f"the prefill server ({P}) 1, the decode server ({D}) unknown" in why
    n = ledger.begin("/update_weights_from_disk", b'{"model_path": "/w/step-2"}')
    ledger.took(P, n, True)
    ledger.took(D, n, True)  # sent again, both took it: together again
    assert ledger.counts() == (2, 2) and ledger.refusal(ledger.counts()) is None
    assert "the prefill server" in (ledger.refusal(before, ledger.counts()) or "")  # refused at admission
