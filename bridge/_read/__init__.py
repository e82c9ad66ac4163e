"""The read path: the data model (logical tensors, fragments), the planner, the parallel
executor, strided views, the lazy :class:`Checkpoint` and the verbs that open and reshard."""
