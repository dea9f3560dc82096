"""Recipes: the figures no single pdkv command makes, each as one command.

Some tables of the guides come from several commands run in turn (start a deployment, load it
with `pdkv bench serve`, stop it, do the same for the next topology; or measure the link first
and feed the result to the next benchmark). Each module here runs one such sequence with the
same CLIs a user types (subprocesses, so what is measured is what the guide shows), stops what
it started by PID, and prints the figure's table (or writes its JSON with `--json PATH`), so
`pdkv report` can re-make the figure like any other: `python -m pdkv.report.recipes.<name>`.
"""
