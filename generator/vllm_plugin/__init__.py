"""The looped-model plugin for vLLM: the model classes (`models.py`) and what they run on inside
vLLM's workers (attention slots, the runner hook's step context, latent noise, the record books
of exit depths and log-probs, compiled cores, weight reload, request parameters, settings).
`generator/plugin.py` is the entry point vLLM calls (`generator.plugin:register`)."""
