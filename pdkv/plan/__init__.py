"""Cost model for P/D disaggregation, DCP and the KV pool (`pdkv plan`); imports no torch.

Modules: dtypes (element sizes), groups (state groups and their bytes), model (HF config →
groups), resolve (finding a config.json), links (link presets), costs (handoff, overlap,
break-even), capacity (P:D ratio), pcp (prefill context parallelism's compute,
all-gather and crossover), afd (attention-FFN traffic), planner (figures with their
assumptions), report (text / JSON), cli (`pdkv plan`).
"""
