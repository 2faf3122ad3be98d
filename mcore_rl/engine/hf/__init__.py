"""Hugging Face formats: config.json -> architecture lives in ``engine/arch.py``; here the tensor names
(``mapping``), safetensors reading and writing (``safetensors_io``), classifier heads (``score_head``) and the
full-state load every engine starts from (``state``)."""
