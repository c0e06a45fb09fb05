"""Cross-framework conformance: shared fixtures from the float64 oracle, one runner.

Run ``multiattn conformance`` (or ``python -m multiattn.conformance``). The fixtures ship
in ``multiattn/conformance/fixtures``; ``python -m multiattn.conformance.generate --check``
proves they still match the oracle.
"""
