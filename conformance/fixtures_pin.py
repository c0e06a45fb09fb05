"""Written by ``python -m multiattn.conformance.generate``: do not edit.

The sha256 of the canonical JSON of the shipped ``fixtures/manifest.json`` (see
`multiattn.conformance.fixtures.manifest_digest`). The manifest holds the cases, their
tolerances and the sha256 of every archive, so this one value, in the code, vouches for
all of the shipped fixtures.
"""

MANIFEST_SHA256 = "093bce9b80b59f3455e46266e195bc63daa1fa97e3cd136399df22a2fd9043fa"
