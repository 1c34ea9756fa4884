"""The xhal conformance suite: run ``xhal-conformance --device NAME`` against any platform."""
