"""The data a run trains on, one `.npz` in MedMNIST's layout whatever its kind (docs/architecture.md):

- ``names``: what each kind of file is named, and the fix for a bad one, told by its name;
- ``shipped``: the MedMNIST files that ship in ``data/medmnist`` and the ``${shipped:...}`` resolver that finds them;
- ``medmnist``: MedMNIST's official files: medmnist's catalogue, their MD5, their download;
- ``synthetic``: ``data=synthetic``'s generated task;
- ``nifti``: ``data=nifti``'s folder of volumes and labels CSV, preprocessed once into a cache;
- ``npz``: the layout all of them share, read and checked;
- ``files``: the file a config trains on, checked or made; its classes and split sizes;
- ``loaders``: the splits as tensors and the seeded loaders over them.

Nothing is imported here: ``src/__init__`` imports :mod:`src.data.shipped` in every command, before its config is
checked, and only ``names`` and ``shipped`` are light enough for that (no numpy, no torch).
"""
