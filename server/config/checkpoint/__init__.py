"""What the config check reads of a checkpoint without loading it.  No torch.

    architecture.py   DeepseekConfig: the checkpoint's config.json, validated (the model
                      reads it through server/model/config.py)
    kv_block.py       the bytes of one KV block of this checkpoint (the disk tier's minimum)
    fingerprint.py    the weights' content fingerprint (PD layouts, the disk tier's folder)
"""
