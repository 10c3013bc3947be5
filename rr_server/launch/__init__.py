"""``rr-server launch vllm|sglang``: the launchers (:mod:`.vllm`, :mod:`.sglang`), the options they share
(:mod:`.options`), the watchdog that ties an engine to its launcher (:mod:`.lifeline`) and local server processes
(:mod:`.process`)."""
