"""medsweep: measure how to train 3D medical-image classifiers fastest and in the least memory."""

from src import shipped

shipped.register()  # here, so every composition of conf/ (it imports src) resolves ${shipped:...}
