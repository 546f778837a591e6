"""The data tests' tokenizer fixtures, shared with the curation tools' tests."""

from tests.data.conftest import chatml, chatml_dir, tokenizer_json  # noqa: F401
