"""Drafter training: data, features, draft vocabulary, training-time test, trainer."""
