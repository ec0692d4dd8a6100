output "bucket_name" {
  description = "Name of the checkpoint bucket."
  value       = google_storage_bucket.this.name
}

output "bucket_url" {
  description = "gs:// URL of the bucket."
  value       = google_storage_bucket.this.url
}

output "run_url_prefix" {
  description = "URL prefix for cloudckpt runs: pass run_url_prefix + \"<run name>\" to CheckpointManager."
  value       = local.run_url_prefix
}

output "writer_role" {
  description = "Role granted to the writer service accounts."
  value       = local.writer_role
}

output "writer_permissions" {
  description = "Permissions of the custom writer role."
  value       = local.writer_permissions
}
