"""rr's SGLang patch: rr wire format in TokenizerManager answers, routing forced on, /rr/info (0.5.7-0.5.23)."""
