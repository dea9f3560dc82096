"""`pdkv report`: every measured table of README.md and docs/ as a registered figure, re-made by
one command with the machine it ran on beside it (docs/ARCHITECTURE.md, "Figures")."""
