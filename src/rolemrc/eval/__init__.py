"""Evaluation: generation backends, reference metrics, LLM judge, rule verifiers, reports."""
