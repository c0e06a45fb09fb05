"""Written by ``python -m multiattn.conformance.generate``: do not edit.

The sha256 of the canonical JSON of the shipped ``fixtures/manifest.json`` (see
`multiattn.conformance.fixtures.manifest_digest`). The manifest holds the cases, their
tolerances and the sha256 of every archive, so this one value, in the code, vouches for
all of the shipped fixtures.
"""

MANIFEST_SHA256 = "c5068ab4995140d68bbcc3138ae921fbdb552fa2883c1941dd7b78eeb08ba5b7"
