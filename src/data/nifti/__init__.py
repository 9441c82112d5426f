"""``data=nifti``: a folder of volumes and a labels CSV, preprocessed once into a cached `.npz` in MedMNIST's layout
(docs/nifti.md): the CSV (``table``), the volumes (``preprocess``), the cache (``cache``);
``python -m src.volumes data=nifti data.root=<folder>`` builds the cache and describes it."""
