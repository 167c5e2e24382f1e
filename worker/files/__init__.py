"""Where a job's files go and what they carry: the local and S3 stores, image details."""
