"""An out-of-tree xhal platform, registered through the ``xhal.platforms`` entry point.

Importing this package is cheap on purpose: the registry imports ``xhal_oot_example.platform``
only when the platform is first asked for.
"""
