"""The Ray routing store on a local Ray cluster the session starts (needs ray; one test a vLLM CPU server)."""
