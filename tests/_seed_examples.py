"""The old name of :mod:`_reference_examples`, for tests that still import it from here."""

from _reference_examples import document_text, example, with_imports

__all__ = ["document_text", "example", "with_imports"]
