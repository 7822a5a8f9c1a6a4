"""What a run leaves: the recorder, TensorBoard files, tables and plots."""
