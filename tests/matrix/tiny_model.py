"""Sizes of the matrix's tiny-llama checks (shared by conftest.py and the tests)."""

TINY_PROMPT_LENS = (15, 16, 17, 33, 50)
TINY_NEW_TOKENS = 12
