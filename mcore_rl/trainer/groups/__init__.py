"""The RL driver's handles on its worker groups: whole batches in, whole batches out."""
