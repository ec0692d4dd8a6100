output "bucket_name" {
  description = "Name of the checkpoint bucket."
  value       = aws_s3_bucket.this.bucket
}

output "bucket_arn" {
  description = "ARN of the checkpoint bucket."
  value       = aws_s3_bucket.this.arn
}

output "run_url_prefix" {
  description = "URL prefix for cloudckpt runs: pass run_url_prefix + \"<run name>\" to CheckpointManager."
  value       = local.run_url_prefix
}

output "writer_policy_arn" {
  description = "ARN of the training writer policy."
  value       = aws_iam_policy.writer.arn
}

output "writer_policy_json" {
  description = "The writer policy document (for inline use or review)."
  value       = data.aws_iam_policy_document.writer.json
}

output "restore_policy_arn" {
  description = "ARN of the read-only restore policy (null if not created)."
  value       = one(aws_iam_policy.restore[*].arn)
}

output "restore_policy_json" {
  description = "The read-only restore policy document."
  value       = data.aws_iam_policy_document.restore.json
}

output "gc_policy_arn" {
  description = "ARN of the garbage-collector policy (null if not created)."
  value       = one(aws_iam_policy.gc[*].arn)
}

output "gc_policy_json" {
  description = "The garbage-collector policy document."
  value       = data.aws_iam_policy_document.gc.json
}
