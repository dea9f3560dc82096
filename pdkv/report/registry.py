"""Every figure of README.md and docs/*.md (`pdkv report --list`). A guide's measured table sits
in a block `<!-- figure: ID -->` ... `<!-- /figure -->`; its data is docs/figures/ID.json.

To add one: put the two markers around the table (or printed output) in its guide, register a
`Figure` here (the command that prints or writes it, the code it measures, its requests per
point, and `table_header` or `convert` to pick its table), then `pdkv report --only ID`. The
figures whose data say "transcribed from the guide" were copied from the guides' text when the
registry came: their machine fields are what the text said of the run ("unknown" elsewhere)."""

from __future__ import annotations

from pdkv.report.figures import ENGINE, PD, PDKV, SERVING, Figure

PY = ("{python}", "-m")
OFFLINE = (*ENGINE, "pdkv/bench/offline")
# The code every recipe (pdkv/report/recipes/) runs its commands with.
RECIPE = ("pdkv/report/recipes/procs.py", "pdkv/report/recipes/common.py",
          "pdkv/report/recipes/steps.py")
HF_LLAMA = "transformers (HF peer), llama-cpp-python and its GGUFs (`make llama-cpp`)"
# The link measured by `pdkv bench transfer`, then the handoff predicted with it.
HANDOFF_MEASURED = (*PD, "pdkv/plan", "pdkv/bench/handoff", "pdkv/bench/transfer",
                    "pdkv/report/recipes/handoff_measured.py", "pdkv/report/recipes/steps.py")
# One `pdkv compare` run makes every figure of docs/COMPARE.md.
COMPARE = (*PDKV, "compare", "--num-prompts", "20", "--out", "{dir}/COMPARE.md")
COMPARE_MEASURES = (*PD, "pdkv/kvpool", "pdkv/bench/compare", "pdkv/plan")

# `pdkv bench offline` against both peers: the per-ISA speed tables and goals of docs/SPEED.md.
SPEED_RUN = (*PDKV, "bench", "offline", "--peer", "hf,llama.cpp", "--batch-sizes", "1,8,32,64",
             "--num-threads", "2", "--repeats", "2")
SPEED_BF16_RUN = (*PDKV, "bench", "offline", "--dtype", "bfloat16", "--peer", "hf,llama.cpp",
                  "--batch-sizes", "1,8,32,64", "--num-threads", "2", "--repeats", "2")

FIGURES: tuple[Figure, ...] = (
    # docs/SPEED.md
    # One table per ISA, each made only on its CPU (Figure.isa); both from SPEED_RUN. SPEED's
    # other figures are AVX2 runs its prose describes as such: made only on an AVX2-only CPU.
    *(Figure(f"speed-{isa}-{part}", "docs/SPEED.md", SPEED_RUN, OFFLINE, needs=HF_LLAMA,
             table_header=header, isa=isa)
      for isa in ("avx2", "avx512")
      for part, header in (("offline", "workload (tok/s)"), ("goals", "goal (float32)"))),
    *(Figure(f"speed-avx512-bf16{part}", "docs/SPEED.md", SPEED_BF16_RUN, OFFLINE,
             needs=HF_LLAMA, table_header=header, isa="avx512")
      for part, header in (("", "workload (tok/s)"), ("-goals", "goal (bfloat16)"))),
    Figure("speed-profile-step", "docs/SPEED.md",
           (*PY, "pdkv.bench.model.profile_step", "--decode-batches", "1,64", "--prefill", "512",
            "--prefill-cases", "64x128", "--repeats", "3"),
           (*ENGINE, "pdkv/bench/model/profile_step.py"), table_header="step", isa="avx2"),
    Figure("speed-offline-vs-hf", "docs/SPEED.md",
           (*PDKV, "bench", "offline", "--batch-sizes", "1,8,32", "--repeats", "3"), OFFLINE,
           needs="transformers (HF peer)", table_header="batch", isa="avx2"),
    # An earlier session's run of speed-avx2-offline's command, before the limit rows existed,
    # that the guide discusses as such ("Against llama.cpp").
    Figure("speed-vs-llamacpp", "docs/SPEED.md",
           (*PDKV, "bench", "offline", "--peer", "hf,llama.cpp", "--batch-sizes", "1,8,32,64",
            "--num-threads", "2", "--repeats", "2"), OFFLINE, needs=HF_LLAMA,
           table_header="workload (tok/s)", rerun=False,
           how="an earlier session's run of this command (panel kernel, decode timed inside "
           "each run), before the limit rows; speed-avx2-offline is the current one"),
    Figure("speed-decode-backends", "docs/SPEED.md",
           (*PDKV, "bench", "offline", "--attention-backends", "torch,cpu_paged",
            "--batch-sizes", "1,32,64", "--num-threads", "2"), OFFLINE, table_header="batch",
           isa="avx2"),
    Figure("speed-prefill-backends", "docs/SPEED.md",
           (*PDKV, "bench", "offline", "--attention-backends", "torch,cpu_paged",
            "--batch-sizes", "1", "--output-len", "4", "--num-threads", "2", "--repeats", "2"),
           OFFLINE, table_header="prefill B x L", isa="avx2"),
    Figure("speed-fused-ops", "docs/SPEED.md",
           (*PDKV, "bench", "offline", "--attention-backends",
            "torch,cpu_paged,cpu_paged:no-fused", "--batch-sizes", "1,32", "--output-len", "16",
            "--num-threads", "2"), OFFLINE, table_header="batch", isa="avx2"),
    Figure("speed-weight-stream", "docs/SPEED.md",
           (*PY, "pdkv.bench.model.weight_stream", "--repeats", "10"),
           ("pdkv/model/hugepages.py", "pdkv/model/panel_linear.py", "pdkv/model/csrc",
            "pdkv/bench/model/weight_stream.py"), table_header="placement", isa="avx2"),
    Figure("speed-panel-linear", "docs/SPEED.md",
           (*PY, "pdkv.model.panel_linear", "--repeats", "5"),
           ("pdkv/model/panel_linear.py", "pdkv/model/csrc", "pdkv/model/linear_table.py"),
           convert="pdkv.report.convert:panel_linear", isa="avx2"),
    Figure("speed-cpu-linears", "docs/SPEED.md",
           (*PDKV, "bench", "offline", "--cpu-linears", "onednn,auto,torch", "--batch-sizes",
            "1,8,32", "--input-len", "128", "--output-len", "16", "--num-threads", "2",
            "--prefill-cases", ""), OFFLINE, table_header="batch", isa="avx2"),
    Figure("speed-cpu-linear-us", "docs/SPEED.md", (*PY, "pdkv.report.recipes.cpu_linear"),
           ("pdkv/model/cpu_linear.py", "pdkv/model/linear_table.py",
            "pdkv/model/linear_backend.py", "pdkv/report/recipes/cpu_linear.py",
            "pdkv/report/recipes/steps.py"),
           table_header="rows", isa="avx2"),
    Figure("speed-bf16-vs-hf", "docs/SPEED.md",
           (*PDKV, "bench", "offline", "--dtype", "bfloat16", "--batch-sizes", "1,8",
            "--input-len", "64", "--output-len", "8", "--num-threads", "2"), OFFLINE,
           needs="transformers (HF peer)", table_header="batch", isa="avx2"),
    Figure("speed-bf16-vs-llamacpp", "docs/SPEED.md",
           (*PDKV, "bench", "offline", "--dtype", "bfloat16", "--peer", "hf,llama.cpp",
            "--batch-sizes", "1,8", "--input-len", "64", "--output-len", "8",
            "--long-prefill-len", "128", "--num-threads", "2"), OFFLINE, needs=HF_LLAMA,
           table_header="workload (tok/s)", isa="avx2"),
    # docs/ARCHITECTURE.md
    Figure("arch-profile-torch-ops", "docs/ARCHITECTURE.md",
           (*PY, "pdkv.bench.model.profile_step", "--threads", "1", "--no-fused-ops",
            "--repeats", "2", "--cpu-linear", "onednn"),
           (*ENGINE, "pdkv/bench/model/profile_step.py"), table_header="step"),
    # docs/COMPARE.md (the report `pdkv compare` writes: its three tables, then its generated
    # notes with the plots and compare.json it links)
    *(Figure(f"compare-{part}", "docs/COMPARE.md", COMPARE, COMPARE_MEASURES,
             requests_per_point=20, percentiles=part == "latency", table_index=i,
             table_source="COMPARE.md")
      for i, part in enumerate(("latency", "phases", "plan"))),
    Figure("compare-notes", "docs/COMPARE.md", COMPARE, COMPARE_MEASURES, requests_per_point=20,
           kind="markdown", convert="pdkv.report.convert:compare_notes",
           keep=("compare/*.png", "compare/compare.json")),
    # docs/ACROSS_HOSTS.md
    Figure("across-hosts-links", "docs/ACROSS_HOSTS.md",
           (*PDKV, "bench", "hosts", "--deploy", "examples/deploy/1p1d-smollm2.toml", "--netns",
            "--link-rates", "loopback,1gbit,110mbit", "--link-delay", "0.5ms", "--num-prompts",
            "24", "--input-len", "512", "--output-len", "32", "--json", "{json}"),
           (*PD, "pdkv/bench/hosts.py"), requests_per_point=24, percentiles=True,
           needs="root (network namespaces)", table_header="case"),
    # docs/HYBRID_STATE.md
    Figure("hybrid-group-bytes", "docs/HYBRID_STATE.md",
           (*PDKV, "bench", "groups", "--num-threads", "2", "--json", "{json}"),
           (*PD, "pdkv/modelspec", "pdkv/bench/groups"), requests_per_point=3,
           convert="pdkv.report.convert:groups"),
    # docs/KV_POOL.md
    Figure("kv-pool-local", "docs/KV_POOL.md",
           (*PDKV, "bench", "pool", "--tiers", "dram,disk", "--chunk-size", "256",
            "--prompt-len", "2049", "--repeats", "3"),
           (*ENGINE, "pdkv/kvpool", "pdkv/kv_transfer", "pdkv/bench/pool"), requests_per_point=3,
           kind="text"),
    Figure("kv-pool-remote", "docs/KV_POOL.md",
           (*PDKV, "bench", "pool", "--tiers", "redis,mooncake"),
           (*ENGINE, "pdkv/kvpool", "pdkv/kv_transfer", "pdkv/bench/pool"), requests_per_point=3,
           needs="redis-server, mooncake-transfer-engine", kind="text"),
    Figure("kv-pool-routing-first", "docs/KV_POOL.md", (), (*SERVING, "pdkv/kvpool"),
           rerun=False, kind="text",
           how="python -m pdkv.bench.compare.routing --routing round_robin prefix_aware --pool "
           "redis --pool-chunk-size 64 (its first version, at commit a7e47d5)"),
    # docs/LEARNING.md (the guided path's measured steps)
    Figure("learning-handoff-loaded", "docs/LEARNING.md",
           (*PDKV, "bench", "handoff", "--transfer", "tcp", "--prompt-lens", "1024", "--repeats",
            "3"), (*PD, "pdkv/plan", "pdkv/bench/handoff"), requests_per_point=3, kind="text",
           exit_codes=(0, 1)),
    Figure("learning-handoff-quiet", "docs/LEARNING.md",
           (*PY, "pdkv.report.recipes.handoff_measured", "--transfer", "tcp", "--prompt-lens",
            "1024,4096", "--json", "{json}"), HANDOFF_MEASURED, requests_per_point=3, kind="text",
           convert="pdkv.report.convert:handoff_pulls"),
    Figure("learning-pool", "docs/LEARNING.md",
           (*PDKV, "bench", "pool", "--tiers", "dram,disk", "--prompt-len", "1025",
            "--chunk-size", "256", "--repeats", "1"),
           (*ENGINE, "pdkv/kvpool", "pdkv/kv_transfer", "pdkv/bench/pool"), requests_per_point=1,
           kind="text"),
    Figure("learning-disk-fsync", "docs/LEARNING.md",
           (*PDKV, "bench", "pool", "--disk-fsync"), ("pdkv/kvpool", "pdkv/bench/pool"),
           requests_per_point=20, percentiles=True, kind="text"),
    # docs/PLAN.md
    Figure("plan-handoff-measured", "docs/PLAN.md",
           (*PY, "pdkv.report.recipes.handoff_measured", "--json", "{json}"), HANDOFF_MEASURED,
           requests_per_point=3, kind="text"),
    Figure("plan-weak-link", "docs/PLAN.md",
           (*PDKV, "bench", "handoff", "--link-rate", "1gbit", "--prompt-lens", "1024,4096",
            "--repeats", "3", "--result-json", "{json}"),
           (*PD, "pdkv/plan", "pdkv/bench/handoff", "pdkv/bench/netns.py"), requests_per_point=3,
           kind="text", needs="root (network namespaces)", exit_codes=(0, 1)),
    # docs/MEMORY.md
    Figure("memory-rss", "docs/MEMORY.md", (*PDKV, "bench", "memory"),
           (*SERVING, "pdkv/bench/memory.py", "pdkv/malloc_tuning.py"),
           convert="pdkv.report.convert:memory"),
    # docs/PARALLEL_TIERS.md
    Figure("parallel-pcp", "docs/PARALLEL_TIERS.md",
           (*PDKV, "bench", "pcp", "--model", "tiny-llama-kv2,smollm2", "--prompt-lens",
            "128,256,512,1024,2048", "--repeats", "3", "--json", "{json}"),
           (*ENGINE, "pdkv/parallel", "pdkv/plan", "pdkv/bench/pcp.py"), table_header="model"),
    # docs/PD.md
    # the table's first header cell is empty: the recipe prints that one table only (index 0)
    Figure("pd-colocated-vs-1p1d", "docs/PD.md",
           (*PY, "pdkv.report.recipes.colocated_vs_pd", "--num-prompts", "24", "--",
            "--num-kv-blocks", "1024", "--max-model-len", "2048"),
           (*PD, *RECIPE, "pdkv/report/recipes/colocated_vs_pd.py"), requests_per_point=24,
           percentiles=True),
    Figure("pd-prefill-cap", "docs/PD.md",
           (*PDKV, "bench", "prefill-cap", "--caps", "0,32,64", "--num-prompts", "24", "--json",
            "{json}", "--", "--num-kv-blocks", "1024", "--max-model-len", "2048"),
           (*SERVING, "pdkv/bench/prefill_cap.py"), requests_per_point=24, percentiles=True,
           table_header="cap (tokens)"),
    Figure("pd-transfer", "docs/PD.md",
           (*PDKV, "bench", "transfer", "--result-json", "{json}"),
           ("pdkv/kv_transfer", "pdkv/bench/transfer"), convert="pdkv.report.convert:transfer"),
    # docs/PUSH.md
    Figure("push-vs-pull", "docs/PUSH.md",
           (*PY, "pdkv.report.recipes.push_vs_pull", "--json", "{json}"),
           (*PD, "pdkv/plan", "pdkv/bench/handoff", "pdkv/bench/netns.py",
            "pdkv/report/recipes/push_vs_pull.py", "pdkv/report/recipes/steps.py"),
           requests_per_point=2, needs="root (network namespaces)", table_header="link"),
    # docs/RELIABILITY.md
    Figure("reliability-soak", "docs/RELIABILITY.md",
           (*PDKV, "bench", "soak", "--duration", "3600", "--output-dir", "{dir}"),
           (*PD, "pdkv/bench/soak"), convert="pdkv.report.convert:soak",
           exit_codes=(0, 1),  # 1: a check failed, which its table's last row names
           overloads=True),  # its load after (about 3 on 2 cores) is its own
    Figure("reliability-soak-first", "docs/RELIABILITY.md",
           (*PDKV, "bench", "soak", "--duration", "3600", "--output-dir", "{dir}"),
           (*PD, "pdkv/bench/soak"), rerun=False),
    # docs/ROUTING.md
    Figure("routing-policies", "docs/ROUTING.md",
           (*PY, "pdkv.bench.compare.routing", "--result-json", "{json}"),
           (*SERVING, "pdkv/kv_events", "pdkv/bench/compare/routing.py",
            "pdkv/bench/compare/routing_report.py"), requests_per_point=192, percentiles=True,
           convert="pdkv.report.convert:routing"),
    # docs/SERVING.md
    Figure("serving-bench-serve", "docs/SERVING.md",
           (*PY, "pdkv.report.recipes.serving", "--num-prompts", "32", "--",
            "--num-kv-blocks", "2048", "--max-model-len", "2048"),
           (*SERVING, *RECIPE, "pdkv/report/recipes/serving.py"), requests_per_point=32,
           percentiles=True, table_header="metric"),
    # docs/TP_DCP.md
    Figure("tp-dcp-bench", "docs/TP_DCP.md", (*PDKV, "bench", "dcp", "--json", "{json}"),
           (*ENGINE, "pdkv/parallel", "pdkv/bench/dcp"), requests_per_point=32,
           percentiles=True, convert="pdkv.report.convert:dcp"),
    Figure("tp-dcp-hetero", "docs/TP_DCP.md", (*PDKV, "bench", "hetero"),
           (*PD, "pdkv/parallel", "pdkv/bench/hetero"), requests_per_point=3, kind="text"),
    # docs/TTFT.md
    Figure("ttft-proxy-before", "docs/TTFT.md", (), SERVING, requests_per_point=100,
           percentiles=True, rerun=False,
           how="pdkv up --mode pd, then pdkv bench serve --num-prompts 100 per endpoint and "
           "concurrency (the script in docs/TTFT.md)"),
    Figure("ttft-proxy-after", "docs/TTFT.md",
           (*PY, "pdkv.report.recipes.ttft_proxy", "--num-prompts", "100"),
           (*SERVING, *RECIPE, "pdkv/report/recipes/ttft_proxy.py"), requests_per_point=100,
           percentiles=True, table_header="endpoint, concurrency"),
)
