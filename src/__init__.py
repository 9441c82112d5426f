"""medsweep: measure how to train 3D medical-image classifiers fastest and in the least memory."""
