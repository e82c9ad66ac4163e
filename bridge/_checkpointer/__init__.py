"""Lazy, asynchronous, multi-level checkpointing straight into the universal layout.

The levels, one module each: ``leaves`` (what is captured, and the runtimes
that capture it), ``host`` (reused host buffers laid out as file images),
``jobs`` (a save in flight, its timings), ``core`` (the :class:`Checkpointer`: snapshot and
flush threads, commit),
``tree`` (the saved tree's skeleton), ``restore`` (strict restores into live state),
``policy`` (:class:`SavePolicy`: back-pressure and priorities under load),
``steps`` (step directories, retention, clean-up) and ``persist`` (the copy to
a persistent directory or URL). See :class:`Checkpointer`.

The package itself imports nothing, so that adapters importing ``leaves`` (through
``ckptbridge.plugin``) do not load the Checkpointer's threads, storage and restore code;
``ckptbridge.Checkpointer`` and the other public names come from their modules.
"""
