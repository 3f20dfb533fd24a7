"""The application layer: the ``hookloop`` command line and the tools around run directories.

``cli`` is the ``hookloop`` command (``python -m hookloop``); ``runs`` and ``plot`` read
run directories (``hookloop runs``, ``hookloop plot``); ``resume_config`` is what
``hookloop train --resume`` runs with. It sits above the engine and the feature packages
(callbacks, control, tune, diloco, recipes) and uses them; nothing in them imports it.
"""
