"""The shared tier: entries shared between hosts through S3-compatible object storage (--remote-store).

* tier.py: `RemoteTier`, lookups on a miss and uploads after each local commit;
* bucket.py: entries as objects, checked before they are adopted;
* uploads.py: the journaled write-behind that survives a restart;
* s3config.py: the bucket's settings from the URL and the AWS_* variables.

Imported only with --remote-store: obstore (~18 ms) is under it.
"""
