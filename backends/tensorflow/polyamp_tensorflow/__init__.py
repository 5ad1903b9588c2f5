"""polyamp's TensorFlow/Keras backend."""
