# The checkpoint bucket on Google Cloud Storage: uniform bucket-level access (IAM only, no ACLs),
# public access prevented, versioned, with lifecycle rules bounding the cost of versioning.

resource "google_storage_bucket" "this" {
  project       = var.project_id
  name          = var.bucket_name
  location      = var.location
  storage_class = var.storage_class
  force_destroy = var.force_destroy
  labels        = var.labels

  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  versioning {
    enabled = var.versioning_enabled
  }

  soft_delete_policy {
    retention_duration_seconds = var.soft_delete_retention_seconds
  }

  dynamic "encryption" {
    for_each = var.kms_key_name == null ? [] : [var.kms_key_name]
    content {
      default_kms_key_name = encryption.value
    }
  }

  # XML-API multipart uploads abandoned by preempted writers (cloudckpt itself uploads large
  # files as parallel composite uploads under <run>/.cloudckpt/uploads/, which its GC removes).
  lifecycle_rule {
    condition {
      age = var.abort_incomplete_multipart_upload_days
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  # Every commit replaces LATEST and GC deletes whole checkpoints; with versioning those become
  # noncurrent generations, kept for this recovery window only.
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_version_expiration_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }
}

locals {
  objects_prefix = "projects/_/buckets/${google_storage_bucket.this.name}/objects/${var.run_prefix == "" ? "" : "${var.run_prefix}/"}"
  use_condition  = var.restrict_to_run_prefix && var.run_prefix != ""
  run_url_prefix = var.run_prefix == "" ? "gs://${google_storage_bucket.this.name}/" : "gs://${google_storage_bucket.this.name}/${var.run_prefix}/"

  # Exactly what cloudckpt/stores/gcs.py needs (see terraform/README.md for the code paths):
  # objects.insert (create; replacing LATEST on compare-and-swap also needs delete), compose
  # (create + get on the sources), objects.get (data and metadata), objects.list (listing,
  # pending composite uploads, the store clock), objects.delete (part cleanup, abort, GC).
  writer_permissions = [
    "storage.objects.create",
    "storage.objects.delete",
    "storage.objects.get",
    "storage.objects.list",
  ]
  writer_role = var.use_custom_role ? google_project_iam_custom_role.writer[0].id : "roles/storage.objectUser"
}

resource "google_project_iam_custom_role" "writer" {
  count = var.use_custom_role ? 1 : 0

  project     = var.project_id
  role_id     = var.custom_role_id
  title       = "cloudckpt checkpoint writer"
  description = "Save, commit, resume and garbage-collect cloudckpt checkpoints."
  permissions = local.writer_permissions
}

resource "google_storage_bucket_iam_member" "writer" {
  for_each = toset(var.writer_service_accounts)

  bucket = google_storage_bucket.this.name
  role   = local.writer_role
  member = "serviceAccount:${each.value}"

  dynamic "condition" {
    for_each = local.use_condition ? [1] : []
    content {
      title       = "cloudckpt-run-prefix"
      description = "Objects under ${local.run_url_prefix}, plus bucket-level listing"
      expression  = "resource.type == \"storage.googleapis.com/Bucket\" || resource.name.startsWith(\"${local.objects_prefix}\")"
    }
  }
}

resource "google_storage_bucket_iam_member" "restore" {
  for_each = toset(var.restore_service_accounts)

  bucket = google_storage_bucket.this.name
  role   = "roles/storage.objectViewer"
  member = "serviceAccount:${each.value}"

  dynamic "condition" {
    for_each = local.use_condition ? [1] : []
    content {
      title       = "cloudckpt-run-prefix"
      description = "Objects under ${local.run_url_prefix}, plus bucket-level listing"
      expression  = "resource.type == \"storage.googleapis.com/Bucket\" || resource.name.startsWith(\"${local.objects_prefix}\")"
    }
  }
}
