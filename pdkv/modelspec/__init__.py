"""A model's state groups as its HF config.json declares them (torch-free, no pdkv import below
it): the groups and their bytes per token (`groups`), element types (`dtypes`) and the reader of
a config dict (`hf_config`). The cost model (`pdkv.plan`) sizes deployments from them; the model
code (`pdkv.model.arch_config`) uses the reader to refuse state kinds an architecture lacks."""
