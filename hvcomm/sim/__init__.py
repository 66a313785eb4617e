"""What runs beside the training: the simulator, the advisor, the models and traces they read,
profiling a model of one's own into a trace, and replay (a traced model through the real
optimizer). The simulator and the advisor need no MPI library."""
